"""The cluster as the router sees it: live workers (registry, health) and the calls to them."""
