"""Policy plug-ins for tests; this folder is on the served processes' PYTHONPATH (see servers.subprocess_env)."""
