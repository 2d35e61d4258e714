"""Repository tools that are neither product nor tests: generators of docs and the numbers the docs quote."""
