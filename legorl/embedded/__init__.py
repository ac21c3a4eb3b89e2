"""The embedded default: the whole loop on one machine (`legorl run`), no cluster and no GPU needed."""
