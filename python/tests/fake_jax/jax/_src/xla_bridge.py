"""jax._src.xla_bridge: the initialised backends, by platform (empty until first use)."""

_backends = {}
initialisations = []  # each backend initialisation, for the tests
