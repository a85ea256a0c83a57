"""The Helm chart: rendered by the real helm and installed into the real control plane."""
