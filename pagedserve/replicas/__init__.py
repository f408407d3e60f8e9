"""Replicas of the pagedserve server on Ray Serve, behind one OpenAI-compatible ingress
(`pagedserve serve-ray`): see `app.py`."""
