"""The kopf controller: handlers, planning, and the Kubernetes client."""
