"""Hydra configs of ``pl-pipedream-train`` (a package so that Hydra finds them when installed)."""
