"""A trial's proxy as both trial backends see it: how it is started (`command`) and how it is asked
about the trial (`client`).

The Kubernetes backend (`legorl.operator`) renders the proxy as a sidecar of the trial pod; the local
backend (`legorl.embedded`) starts it as a process on a Unix socket. Both take its command line from
`command.proxy_command` and talk to it through `client.ProxyClient`. `command` is pure (the operator's
renderer imports it); only `client` imports an HTTP client.
"""
