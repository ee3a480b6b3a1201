"""End-to-end tests with real processes; ``e2e.stack`` is the reusable process stack."""
