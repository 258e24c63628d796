"""Plain records every layer shares: events and tuples, the mark's bit layout, cookies."""
