"""Pure status computation: observed children and a clock in, a status out (no client)."""
