"""The Keras judge: Keras's shipped tests run plainly and with every compiled model a DistributedModel (issue 26; `python -m tests.mpi.keras_judge`)."""
