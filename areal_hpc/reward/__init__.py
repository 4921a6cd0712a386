"""Built-in reward functions (math, exact and regex match, code tests) and a sandbox for untrusted code."""
