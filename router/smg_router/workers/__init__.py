"""workers: worker data (spec, status, breaker, registry, load view), below the policies that read it."""
