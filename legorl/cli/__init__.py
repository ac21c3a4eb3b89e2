"""The `legorl` command line."""
