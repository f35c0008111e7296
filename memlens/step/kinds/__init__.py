"""Step kinds other than the plain step: DP-SGD with Opacus (:mod:`.opacus`)."""
