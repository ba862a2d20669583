"""Images and the container flow: Dockerfile stages built with buildah or Docker, the
suites inside the images, and host checks."""
