"""The gateway: the public API in front of the mesh, and the pipeline behind it."""
