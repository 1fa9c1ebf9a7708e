"""The streaming runtime: policy, budgets, plan, the executor's schedule, slots and K/V cache."""
