"""An IDS's rules: the HTTP API and its process, the store, precedence, a rule's end."""
