"""What the router knows about its fleet: the bottom layer under the policies, the proxy and the
evaluation. It imports nothing above it (not the policies, the proxy, the twin or bench)."""
