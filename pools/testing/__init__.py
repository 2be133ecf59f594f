"""Test doubles that ship with gpupool (as httpx ships its MockTransport): a fast fake vLLM
engine and a helper that serves any ASGI app on a free local port."""
