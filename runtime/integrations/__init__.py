"""plait under the engines platform teams already run: Ray Serve (`ray_serve`, `ray_router`; needs
`pip install "ray[serve]"`). Nothing here is imported by the runtime itself."""
