"""Parallelism: the device mesh, the policy's rules, applying composable APIs through torch's
registry, the plan of what each rank holds, and the planner that makes it on the fake
process group without ranks."""
