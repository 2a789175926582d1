"""The native CPU kernels: building and loading the library, and asking what it serves."""
