"""The config, typed and checked: every key, static entries, what a reload may change."""
