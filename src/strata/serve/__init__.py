"""`strata serve`: an OpenAI-compatible HTTP server over the decode loop."""
