"""What every Baton service shares: the gRPC server factory, client channels, limits."""
