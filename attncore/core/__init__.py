"""The core layer: the backend contract (``backend``: ``BatchMeta``, ``RunArgs``, ``Backend``), the
problem and its parameters (``problem``, ``params``, ``mask``), capabilities and refusal reasons
(``capabilities``), the plugin registry and its hook (``registry``, ``hooks``), the auto selector and its
ranking table (``selector``, ``ranking``), the input checks the public API shares (``_api``) and the
``torch.library`` ops (``ops``).  Model code imports the public modules above this package; plugin
authors import the names ``attncore`` re-exports (``Backend``, ``Capabilities``, ``hookimpl`` ...)."""
