"""Model builders: the tiny local models of the CPU quickstarts (`asyncrl.models.tiny`) and which
model a run trains (`asyncrl.models.resolve`)."""
