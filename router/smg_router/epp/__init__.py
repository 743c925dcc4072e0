"""The Endpoint Picker face (Gateway API Inference Extension): Envoy's ext_proc asks, the routing core answers.

Beside the HTTP faces (``handlers``, ``admin``): it calls the request path's parsing, the proxy's preparation and the
attempts, and nothing below imports it.  ``pick`` chooses, ``stream`` follows one ext_proc stream, ``server`` serves
them and the gRPC health service.
"""
