"""The native CPU kernels: choosing and loading the library variant built with the
package for this CPU, and asking what it serves."""
