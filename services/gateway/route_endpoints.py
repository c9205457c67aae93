"""A route's endpoint, by its path and method: how the routes that stand in for others (SageMaker's
/invocations and /ping, Vertex AI's predict and health routes) reach the API's own."""
from __future__ import annotations

from fastapi import FastAPI
from starlette.routing import Route


def route_endpoint(app: FastAPI, path: str, method: str):
    return next(route.endpoint for route in app.routes
                if isinstance(route, Route) and route.path == path and method in (route.methods or ()))
