"""fleet: keeping the registry, the policies and the load view in step with the real workers (above policies)."""
