"""Pure renderers: a custom resource in, the Kubernetes objects it should own out (no client)."""
