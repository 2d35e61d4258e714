"""The engine of a pod: history, router, lanes and readiness behind ``engine_api.EngineClient``."""
