"""`asyncrl inspect RUN_DIR...`: a run's metrics, kept rollouts and evaluations in the browser (docs/inspect.md)."""
