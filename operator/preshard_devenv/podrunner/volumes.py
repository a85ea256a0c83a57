"""What a pod's environment and volumes are made of: its Secrets and ConfigMaps (read with the
runner's credentials), its fields (the downward API) and bound ServiceAccount tokens, written
as local files with the kubelet's modes; and the container paths that lead to them."""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from preshard_devenv.podrunner.podspec import ConfigError, PathMap, expand, identity

PRIVATE: Final = 0o700


class PodSources:
    """One pod's sources of environment and files, and its volumes once mounted."""

    def __init__(self, api: k8s.ApiClient, pod: dict[str, Any], pod_dir: Path) -> None:
        self._api = api
        self.pod = pod
        self.namespace, self.name, self.uid = identity(pod)
        self.dir = pod_dir
        self.volumes: dict[str, Path] = {}

    def environment(self, container: Mapping[str, Any]) -> dict[str, str]:
        """A container's own environment: `envFrom`, then `env` (`$(VAR)` expanded)."""
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "secretRef" in source:
                ref = source["secretRef"]
                data = self._secret(ref["name"], optional=bool(ref.get("optional")))
            elif "configMapRef" in source:
                ref = source["configMapRef"]
                data = self._config_map(ref["name"], optional=bool(ref.get("optional")))
            else:
                continue
            env.update({f"{prefix}{k}": v for k, v in (data or {}).items()})
        for var in container.get("env") or []:
            name = var["name"]
            if "valueFrom" in var:
                value = self._value_from(var["valueFrom"])
                if value is not None:
                    env[name] = value
            else:
                env[name] = expand(var.get("value", ""), env)
        return env

    def _value_from(self, source: Mapping[str, Any]) -> str | None:
        for field, kind, read in (
            ("secretKeyRef", "Secret", self._secret),
            ("configMapKeyRef", "ConfigMap", self._config_map),
        ):
            if field not in source:
                continue
            ref = source[field]
            optional = bool(ref.get("optional"))
            data = read(ref["name"], optional=optional)
            if data is None or (optional and ref["key"] not in data):
                return None
            if ref["key"] not in data:
                raise ConfigError(
                    f"couldn't find key {ref['key']} in {kind} {self.namespace}/{ref['name']}"
                )
            return data[ref["key"]]
        if "fieldRef" in source:
            return self.field(source["fieldRef"]["fieldPath"])
        raise ConfigError(f"the test pod runner does not support env valueFrom {sorted(source)}")

    def field(self, path: str) -> str:
        """The value of a `fieldRef` (`metadata.name`, `metadata.labels['k']`, ...)."""
        meta = self.pod["metadata"]
        spec = self.pod["spec"]
        simple = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "metadata.uid": self.uid,
            "spec.nodeName": spec.get("nodeName", ""),
            "spec.serviceAccountName": spec.get("serviceAccountName", ""),
            "status.podIP": "127.0.0.1",
            "status.hostIP": "127.0.0.1",
        }
        if path in simple:
            return str(simple[path])
        match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if match:
            return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
        raise ConfigError(f"the test pod runner does not support fieldRef {path}")

    def _secret(self, name: str, *, optional: bool) -> dict[str, str] | None:
        data = self._secret_bytes(name, optional=optional)
        return None if data is None else {k: v.decode() for k, v in data.items()}

    def _secret_bytes(self, name: str, *, optional: bool) -> dict[str, bytes] | None:
        read = k8s.CoreV1Api(self._api).read_namespaced_secret
        secret = self._read("secret", name, read, optional=optional)
        if secret is None:
            return None
        return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}

    def _config_map(self, name: str, *, optional: bool) -> dict[str, str] | None:
        read = k8s.CoreV1Api(self._api).read_namespaced_config_map
        config_map = self._read("configmap", name, read, optional=optional)
        return None if config_map is None else dict(config_map.data or {})

    def _read(
        self, kind: str, name: str, read: Callable[[str, str], Any], *, optional: bool
    ) -> Any:
        """An object of the pod's namespace; a missing one is None where the pod marks it
        optional, else the kubelet's error."""
        try:
            return read(name, self.namespace)
        except ApiException as error:
            if error.status != 404:
                raise
        if optional:
            return None
        raise ConfigError(f'{kind} "{name}" not found')

    def mount_volumes(self) -> None:
        """Every volume of the pod as a local directory (or the host path itself)."""
        root = self.dir / "volumes"
        for volume in self.pod["spec"].get("volumes") or []:
            name = volume["name"]
            if "hostPath" in volume:
                self.volumes[name] = Path(volume["hostPath"]["path"])
                continue
            target = root / name
            target.mkdir(parents=True, exist_ok=True)
            self.volumes[name] = target
            if "emptyDir" in volume:
                continue
            files = self._volume_files(volume)
            if files is None:
                raise ConfigError(
                    f'volume "{name}": this volume type is not supported by the test pod runner'
                )
            for relative, (data, mode) in files.items():
                path = target / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.unlink(missing_ok=True)
                with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as handle:
                    handle.write(data)
                    os.fchmod(handle.fileno(), mode)

    def _volume_files(self, volume: Mapping[str, Any]) -> dict[str, tuple[bytes, int]] | None:
        if "secret" in volume:
            source = volume["secret"]
            return self._secret_files(source, source.get("defaultMode", 0o644))
        if "configMap" in volume:
            source = volume["configMap"]
            return self._config_map_files(source, source.get("defaultMode", 0o644))
        if "downwardAPI" in volume:
            source = volume["downwardAPI"]
            return self._downward_files(source, source.get("defaultMode", 0o644))
        if "projected" in volume:
            source = volume["projected"]
            mode = source.get("defaultMode", 0o644)
            files: dict[str, tuple[bytes, int]] = {}
            for item in source.get("sources") or []:
                if "secret" in item:
                    files.update(self._secret_files(item["secret"], mode))
                elif "configMap" in item:
                    files.update(self._config_map_files(item["configMap"], mode))
                elif "downwardAPI" in item:
                    files.update(self._downward_files(item["downwardAPI"], mode))
                elif "serviceAccountToken" in item:
                    token = item["serviceAccountToken"]
                    files[token["path"]] = (self._token(token).encode(), PRIVATE)
            return files
        return None

    def _secret_files(self, source: Mapping[str, Any], mode: int) -> dict[str, tuple[bytes, int]]:
        name = source.get("secretName") or source.get("name", "")
        data = self._secret_bytes(name, optional=bool(source.get("optional")))
        files = _project(data or {}, source.get("items"), mode, f"Secret {self.namespace}/{name}")
        # The owner's bits are honoured; group and other bits are dropped, because the files
        # sit on a machine shared with other users rather than in a pod's own filesystem.
        return {path: (content, bits & PRIVATE) for path, (content, bits) in files.items()}

    def _config_map_files(
        self, source: Mapping[str, Any], mode: int
    ) -> dict[str, tuple[bytes, int]]:
        name = source["name"]
        data = self._config_map(name, optional=bool(source.get("optional")))
        encoded = {k: v.encode() for k, v in (data or {}).items()}
        return _project(encoded, source.get("items"), mode, f"ConfigMap {self.namespace}/{name}")

    def _downward_files(self, source: Mapping[str, Any], mode: int) -> dict[str, tuple[bytes, int]]:
        files: dict[str, tuple[bytes, int]] = {}
        for item in source.get("items") or []:
            if "fieldRef" not in item:
                raise ConfigError(f"downwardAPI item {item['path']}: only fieldRef is supported")
            value = self.field(item["fieldRef"]["fieldPath"])
            files[item["path"]] = (value.encode(), item.get("mode", mode))
        return files

    def _token(self, source: Mapping[str, Any]) -> str:
        account = self.pod["spec"].get("serviceAccountName") or "default"
        spec = k8s.V1TokenRequestSpec(
            audiences=[source["audience"]] if source.get("audience") else [],
            expiration_seconds=source.get("expirationSeconds", 3607),
            bound_object_ref=k8s.V1BoundObjectReference(
                kind="Pod", api_version="v1", name=self.name, uid=self.uid
            ),
        )
        response = k8s.CoreV1Api(self._api).create_namespaced_service_account_token(
            account, self.namespace, k8s.AuthenticationV1TokenRequest(spec=spec)
        )
        if response.status is None or not response.status.token:
            raise ConfigError(f'no token for service account "{account}"')
        return response.status.token

    def path_map(self, container: Mapping[str, Any]) -> PathMap:
        """A container's mount paths (and termination message path) to local paths."""
        mapping: dict[str, str] = {}
        for mount in container.get("volumeMounts") or []:
            local = self.volumes.get(mount["name"])
            if local is None:
                raise ConfigError(f'volume "{mount["name"]}" is not defined in the pod')
            if mount.get("subPath"):
                local = local / mount["subPath"]
                local.mkdir(parents=True, exist_ok=True)
            mapping[mount["mountPath"]] = str(local)
        message_path = container.get("terminationMessagePath") or "/dev/termination-log"
        mapping[message_path] = str(self.dir / "termination" / container["name"])
        return PathMap(mapping)


def _project(
    data: Mapping[str, bytes],
    items: list[dict[str, Any]] | None,
    mode: int,
    what: str,
) -> dict[str, tuple[bytes, int]]:
    if not items:
        return {key: (value, mode) for key, value in data.items()}
    files: dict[str, tuple[bytes, int]] = {}
    for item in items:
        if item["key"] not in data:
            raise ConfigError(f"couldn't find key {item['key']} in {what}")
        files[item["path"]] = (data[item["key"]], item.get("mode", mode))
    return files
