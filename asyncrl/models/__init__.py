"""Model builders and model-level helpers: the tiny local models of the CPU quickstarts
(`asyncrl.models.tiny`), mixture-of-experts routing (`asyncrl.models.moe`)."""
