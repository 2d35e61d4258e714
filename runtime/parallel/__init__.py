"""The ranks of one pod: process groups, the dispatch protocol between them, and per-rank heartbeats."""
