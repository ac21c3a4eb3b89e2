"""The one Kubernetes API client of the UI and the operator: credentials (`legorl.kube.credentials`, standard
library only) and the async httpx client with its errors and resource paths (`legorl.kube.client`).

Nothing is re-exported here, so that reading credentials does not import httpx."""
