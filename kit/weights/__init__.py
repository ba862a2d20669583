"""Model weights: the store behind models.lock, and the tiny seeded models the CPU default
makes itself."""
