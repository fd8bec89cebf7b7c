"""Small pure helpers with no refrun dependency, shared across layers.

==============  ============================================================================
module          what it is
==============  ============================================================================
``jsonsafe``    strict-JSON copies of results (numpy values, non-finite floats as null)
``printable``   text from a store, a file or a user made safe to print on one line
``thinning``    bounded, spike-preserving views of long curves (indices into the input)
==============  ============================================================================

They import nothing from refrun; every layer may import them.
"""
