"""Episodes: what one prompt turns into. Workflows (built in or yours) run on an ``EpisodeContext``."""
