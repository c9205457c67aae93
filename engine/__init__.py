"""Baton's shared engine: model, weights, paged KV blocks, scheduler, sampler."""
