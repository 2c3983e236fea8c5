"""CLI commands grouped by concern, each module registered in `gcworker.cli`."""
