"""Trust tests: constructs where a wrong gradient would be silent, compared with eager."""
