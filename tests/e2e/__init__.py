"""End-to-end tests with real processes; ``e2e.harness`` is the reusable process stack."""
