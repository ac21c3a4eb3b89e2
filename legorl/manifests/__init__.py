"""Reading and validating legorl manifests: schema, CEL and preflight, with no cluster needed."""

from legorl.manifests.load import Document, ManifestLoadError, load_documents, parse_documents
from legorl.manifests.problems import DocumentReport, Problem
from legorl.manifests.validate import validate_document, validate_documents, validate_paths

__all__ = [
    "Document",
    "DocumentReport",
    "ManifestLoadError",
    "Problem",
    "load_documents",
    "parse_documents",
    "validate_document",
    "validate_documents",
    "validate_paths",
]
