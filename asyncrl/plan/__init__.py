"""`asyncrl-plan`: device mapping and execution-plan search for an RL config (HybridFlow §6,
REAL §5). `hardware` holds device profiles, `workload` the models and calls of a step, `cost`
prices a call under a strategy, `search` finds plans, `cli` prints them as launch overrides."""
