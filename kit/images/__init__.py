"""Images and the container flow: Dockerfile stages built with buildah or Docker, the
suites inside the images, host checks, and `make lock`."""
