"""Options of the generated-case suites (hypothesis): registered by the plugin through ``pytest_plugins``."""
