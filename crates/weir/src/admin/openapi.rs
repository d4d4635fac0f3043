//! The OpenAPI 3.1 document served at `/v1/openapi.json`.
//!
//! Hand-written, so it says what the handlers promise rather than what a
//! macro could infer; the test `admin_openapi` walks [`super::route_table`]
//! and this document's paths and fails if either has a route the other lacks.

use serde_json::{Value, json};

fn param(name: &str, location: &str, desc: &str) -> Value {
    json!({
        "name": name, "in": location, "required": location == "path",
        "description": desc, "schema": { "type": "string" }
    })
}

fn body(schema: &str) -> Value {
    json!({ "required": true, "content": { "application/json": {
        "schema": { "$ref": format!("#/components/schemas/{schema}") } } } })
}

fn ok(desc: &str, schema: Value) -> Value {
    json!({ "description": desc, "content": { "application/json": { "schema": schema } } })
}

fn reff(name: &str) -> Value {
    json!({ "$ref": format!("#/components/schemas/{name}") })
}

fn array_of(name: &str) -> Value {
    json!({ "type": "array", "items": reff(name) })
}

/// Standard error answers added to every operation.
fn errors(mut responses: Value, codes: &[&str]) -> Value {
    let err = json!({ "description": "", "content": { "application/json": {
        "schema": { "$ref": "#/components/schemas/Error" } } } });
    for code in codes {
        let mut e = err.clone();
        e["description"] = Value::String(
            match *code {
                "400" => "malformed input (message says what)",
                "401" => "missing or invalid bearer token",
                "403" => "token not allowed (read-only, or another tenant)",
                "404" => "no such tenant, service, backend or connection",
                "409" => "exists already or conflicts",
                "413" => "body larger than 1 MiB",
                "503" => "the daemon cannot do it now",
                _ => "error",
            }
            .into(),
        );
        responses[*code] = e;
    }
    responses
}

fn op(summary: &str, params: Vec<Value>, request: Option<Value>, responses: Value) -> Value {
    let mut o = json!({ "summary": summary, "parameters": params, "responses": responses });
    if let Some(r) = request {
        o["requestBody"] = r;
    }
    o
}

const READ: &[&str] = &["401", "403"];
const WRITE: &[&str] = &["400", "401", "403", "404", "409", "413", "503"];

/// The document.
pub fn document() -> Value {
    let tenant = param("tenant", "path", "tenant name");
    let service = param("service", "path", "service name within the tenant");
    let address = param(
        "address",
        "path",
        "backend IP:PORT (IPv6 as [addr]:port, percent-encoded)",
    );
    let done = || ok("done", json!({ "type": "object" }));
    json!({
      "openapi": "3.1.0",
      "info": {
        "title": "weir admin API",
        "version": "1",
        "description": "Every request needs 'Authorization: Bearer <token>'. The read-only token may only GET; a tenant token sees and changes only its tenant (403 otherwise). Errors are {\"error\": kind, \"message\": text}."
      },
      "components": {
        "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
        "schemas": schemas()
      },
      "security": [ { "bearer": [] } ],
      "paths": {
        "/v1/tenants": {
          "get": op("List tenants (a tenant token sees only its own)", vec![], None,
                    errors(json!({ "200": ok("tenants", array_of("TenantStatus")) }), READ)),
          "post": op("Create a tenant (own table when table_entries > 0)", vec![], Some(body("TenantSpec")),
                     errors(json!({ "201": done() }), WRITE))
        },
        "/v1/tenants/{tenant}": {
          "put": op("Change a tenant's limits, token or timeouts (full-access token only); keys omitted from the body keep their value, \"token\": null removes the token, timeouts is replaced as a whole. table_entries and max_table_entries cannot change (400: delete and re-create the tenant)",
                    vec![tenant.clone()], Some(body("TenantSpec")),
                    errors(json!({ "200": ok("updated", json!({ "type": "object",
                      "properties": { "updated": {"type": "string"} } })) }), WRITE)),
          "delete": op("Delete a tenant, its services and only its connections", vec![tenant.clone()], None,
                       errors(json!({ "200": ok("deleted", json!({ "type": "object",
                         "properties": { "deleted": {"type": "string"}, "closed_connections": {"type": "integer"} } })) }), WRITE))
        },
        "/v1/services": {
          "get": op("List services with backends, counters and rates", vec![], None,
                    errors(json!({ "200": ok("services", array_of("ServiceStatus")) }), READ)),
          "post": op("Add a service (tenant defaults to a tenant token's own, else \"default\")", vec![], Some(body("ServiceSpec")),
                     errors(json!({ "201": done() }), WRITE))
        },
        "/v1/services/{tenant}/{service}": {
          "get": op("A service's configuration (as in the config file)", vec![tenant.clone(), service.clone()], None,
                    errors(json!({ "200": ok("service", reff("ServiceSpec")) }), &["401", "403", "404"])),
          "put": op("Replace a service's settings and backends without dropping established connections; tenant and name may be omitted from the body",
                    vec![tenant.clone(), service.clone()], Some(body("ServiceSpec")),
                    errors(json!({ "200": done() }), WRITE)),
          "delete": op("Delete a service: stop listening, close its connections", vec![tenant.clone(), service.clone()], None,
                       errors(json!({ "200": done() }), WRITE))
        },
        "/v1/services/{tenant}/{service}/backends": {
          "post": op("Add a backend", vec![tenant.clone(), service.clone()], Some(body("BackendSpec")),
                     errors(json!({ "201": done() }), WRITE))
        },
        "/v1/services/{tenant}/{service}/backends/{address}": {
          "put": op("Edit a backend's weight, or drain it", vec![tenant.clone(), service.clone(), address.clone()],
                    Some(body("BackendPatch")), errors(json!({ "200": done() }), WRITE)),
          "delete": op("Remove a backend (established connections finish unless expire_nodest_conn)",
                       vec![tenant.clone(), service.clone(), address.clone()], None,
                       errors(json!({ "200": done() }), WRITE))
        },
        "/v1/connections": {
          "get": op("One page of the connection table; pass `next` back as `cursor` until it is null. Entries present for the whole dump are listed exactly once.",
                    vec![param("tenant", "query", "tenant name"),
                         param("service", "query", "service name"),
                         param("backend", "query", "backend IP:PORT"),
                         param("state", "query", "e.g. ESTABLISHED"),
                         param("cursor", "query", "`next` of the previous page"),
                         param("limit", "query", "page size, 1..=10000 (default 1000)")],
                    None, errors(json!({ "200": ok("page", reff("ConnPage")) }), &["400", "401", "403"]))
        },
        "/v1/connections/{cookie}": {
          "delete": op("Kill one connection", vec![param("cookie", "path", "the connection's cookie (weir conns)")], None,
                       errors(json!({ "200": ok("killed", json!({ "type": "object", "properties": { "killed": {"type": "integer"} } })) }), WRITE))
        },
        "/v1/connections/kill": {
          "post": op("Kill every connection matching a filter; an empty filter needs \"all\": true",
                     vec![], Some(body("KillRequest")),
                     errors(json!({ "200": ok("killed", json!({ "type": "object", "properties": { "killed": {"type": "integer"} } })) }), WRITE))
        },
        "/v1/stats": {
          "get": op("Counters and rates per backend, service, tenant and (not for tenant tokens) global", vec![], None,
                    errors(json!({ "200": ok("stats", reff("Figures")) }), READ))
        },
        "/v1/rates": {
          "get": op("Rates per backend, service, tenant and global", vec![], None,
                    errors(json!({ "200": ok("rates", reff("Figures")) }), READ))
        },
        "/v1/table": {
          "get": op("Flow-table figures per tenant", vec![], None,
                    errors(json!({ "200": ok("tables", array_of("TableReport")) }), READ))
        },
        "/v1/health": {
          "get": op("Health-check state of every backend", vec![], None,
                    errors(json!({ "200": ok("health", array_of("HealthEntry")) }), READ))
        },
        "/v1/whoami": {
          "get": op("Who the presented token is: its role (full, readonly, tenant), its tenant, and whether it may write; the dashboard shows write buttons only when can_write", vec![], None,
                    errors(json!({ "200": ok("the token's role", reff("Whoami")) }), &["401"]))
        },
        "/v1/config": {
          "get": op("The running state in config-file form (weir save prints it as TOML); secrets omitted for the read-only token", vec![], None,
                    errors(json!({ "200": ok("config", json!({ "type": "object" })) }), READ))
        },
        "/v1/reload": {
          "post": op("Re-read the config file: validate all of it, then apply all of it; on any error apply nothing and return every error in `errors`. An empty file is refused, and so is removing objects added through the API since the last reload unless force=true. The answer lists what was (dry_run: would be) added, changed and removed.",
                     vec![param("dry_run", "query", "true: validate and report, apply nothing"),
                          param("force", "query", "true: also remove objects added through the API that the file lacks")],
                     None,
                     errors(json!({ "200": ok("what the reload changed", reff("ReloadReport")) }), &["400", "401", "403"]))
        },
        "/v1/openapi.json": {
          "get": op("This document", vec![], None,
                    errors(json!({ "200": ok("OpenAPI document", json!({ "type": "object" })) }), READ))
        },
        "/metrics": {
          "get": op("Prometheus metrics (OpenMetrics text); public with [admin] metrics_public = true", vec![], None,
                    errors(json!({ "200": { "description": "metrics",
                      "content": { "application/openmetrics-text": { "schema": { "type": "string" } } } } }), READ))
        }
      }
    })
}

fn schemas() -> Value {
    let int = json!({ "type": "integer", "minimum": 0 });
    let s = json!({ "type": "string" });
    let min_health_interval = json!({ "type": "string",
        "description": "shortest [service.health] interval this tenant's token may set, e.g. \"5s\" (1ms..=1h; absent = 1s); an omitted interval counts as its default; the full-access token is not held to it" });
    let totals = json!({ "type": "object", "properties": {
        "conns": int, "inpkts": int, "outpkts": int, "inbytes": int, "outbytes": int } });
    let rates = json!({ "type": "object", "properties": {
        "cps": int, "inpps": int, "outpps": int, "inbps": int, "outbps": int } });
    // Pieces built apart: one json! literal this size hits the macro's
    // recursion limit.
    let boolean = json!({ "type": "boolean" });
    let table_entries = json!({ "type": "integer", "minimum": 0,
        "description": "0: share the global flow table; else a power of two <= 16777216, the entries the tenant's own table starts with (it grows and shrinks online)" });
    let max_table_entries = json!({ "type": "integer", "minimum": 0,
        "description": "own table only: entries it may grow to and hold (inserts past it are refused as table_full); 0 or absent = 16777216, else a power of two >= table_entries" });
    let sched = json!({ "type": "string", "enum": crate::config::SCHEDULERS });
    let mh_sizes = json!({ "type": "integer", "enum": weir_sched::MhTableSize::PRIMES });
    let forward = json!({ "type": "string",
        "enum": crate::config::Forward::ALL.map(crate::config::Forward::as_str),
        "description": "proxy (the default): weir's sockets; nat, fnat, dr: packet mode (needs [packet]); cannot change on a live service" });
    let service_spec = json!({ "type": "object", "required": ["name", "protocol", "listen"], "properties": {
        "tenant": s, "name": s, "protocol": { "type": "string", "enum": ["tcp", "udp"] }, "listen": s,
        "forward": forward.clone(), "scheduler": sched,
        "persistence": s, "persistence_netmask": s, "connect_timeout": s,
        "expire_nodest_conn": { "type": "boolean" }, "mh_fallback": { "type": "boolean" }, "hash_seed": s,
        "sh_fallback": boolean, "sh_port": boolean, "mh_port": boolean, "mh_table_size": mh_sizes,
        "udp_responses": int, "udp_timeout": s, "udp_max_sessions_per_client": int,
        "tcp_max_connections_per_client": int,
        "client_prefix6": { "type": "integer", "minimum": 1, "maximum": 128, "description": "the per-client caps count an IPv6 client per this prefix (default 64)" },
        "sloppy_tcp": { "type": "boolean", "description": "packet TCP services: a non-SYN packet with no flow creates one instead of being dropped" },
        "health": { "type": "object", "properties": { "interval": s, "timeout": s, "rise": int, "fall": int,
            "protocol": { "type": "string", "enum": ["tcp", "udp"] }, "port": int, "send": s } },
        "backend": { "type": "array", "items": { "$ref": "#/components/schemas/BackendSpec" } } } });
    json!({
      "Error": { "type": "object", "required": ["error", "message"], "properties": {
        "error": { "type": "string", "enum": ["invalid", "unauthorized", "forbidden", "not_found", "method_not_allowed", "conflict", "too_large", "unavailable", "internal"] },
        "message": s, "errors": { "type": "array", "items": s } } },
      "Totals": totals,
      "Rates": rates,
      "TenantSpec": { "type": "object", "required": ["name"], "properties": {
        "name": s, "table_entries": table_entries.clone(), "max_table_entries": max_table_entries.clone(),
        "max_connections": int, "max_new_per_s": int, "max_services": int, "max_backends": int,
        "min_health_interval": min_health_interval.clone(), "token": s,
        "timeouts": reff("Timeouts"),
        "allowed_listen": { "type": "array", "items": s, "description": "CIDR[:PORT[-PORT]] where this tenant's token may listen; a wildcard needs an entry naming it" },
        "allowed_backends": { "type": "array", "items": s, "description": "CIDR[:PORT[-PORT]] where this tenant's token may point backends" } } },
      "Timeouts": { "type": "object", "additionalProperties": false,
        "description": "per-state idle timeouts, e.g. \"900s\" (1s..=30 days); absent keys keep the IPVS defaults",
        "properties": { "established": s, "syn_sent": s, "syn_recv": s, "fin_wait": s, "close_wait": s,
                        "last_ack": s, "time_wait": s, "close": s, "udp": s, "persist": s } },
      "TenantStatus": { "type": "object", "properties": {
        "name": s, "table_entries": table_entries, "max_table_entries": max_table_entries,
        "max_connections": int, "max_new_per_s": int, "max_services": int, "max_backends": int,
        "min_health_interval": min_health_interval,
        "timeouts": reff("Timeouts"),
        "allowed_listen": { "type": "array", "items": s }, "allowed_backends": { "type": "array", "items": s },
        "active_conns": int, "refused": int, "table": { "type": "string", "enum": ["own", "shared"] } } },
      "BackendSpec": { "type": "object", "required": ["address"], "properties": {
        "address": s, "weight": int, "proxy_protocol": { "type": "string", "enum": ["v1", "v2"] }, "max_connections": int } },
      "BackendPatch": { "type": "object", "additionalProperties": false, "properties": {
        "weight": int, "drain": { "type": "boolean" } } },
      "ServiceSpec": service_spec,
      "BackendStatus": { "type": "object", "properties": {
        "address": s, "weight": int, "active_conns": int, "inactive_conns": int,
        "health": { "type": "string", "enum": ["up", "down", "unchecked"] },
        "stats": { "$ref": "#/components/schemas/Totals" }, "rates": { "$ref": "#/components/schemas/Rates" } } },
      "ServiceStatus": { "type": "object", "properties": {
        "tenant": s, "name": s, "protocol": s, "listen": s, "forward": forward, "scheduler": s, "persistence": s,
        "persistence_netmask": { "type": ["string", "null"] }, "sched_flags": { "type": "array", "items": s },
        "backends": { "type": "array", "items": { "$ref": "#/components/schemas/BackendStatus" } },
        "stats": { "$ref": "#/components/schemas/Totals" }, "rates": { "$ref": "#/components/schemas/Rates" } } },
      "ConnInfo": { "type": "object", "properties": {
        "tenant": s, "service": s, "proto": s, "client": s, "virtual": s, "backend": s, "state": s,
        "expires_s": int, "cookie": int, "bytes_in": int, "bytes_out": int,
        "packets_in": int, "packets_out": int } },
      "ConnPage": { "type": "object", "properties": {
        "connections": { "type": "array", "items": { "$ref": "#/components/schemas/ConnInfo" } },
        "next": { "type": ["string", "null"] } } },
      "KillRequest": { "type": "object", "additionalProperties": false, "properties": {
        "tenant": s, "service": s, "backend": s, "state": s, "all": { "type": "boolean" } } },
      "TableReport": { "type": "object", "properties": {
        "tenant": s, "placement": { "type": "string", "enum": ["own", "shared"] }, "entries": int, "buckets": int,
        "load_factor": { "type": "number" }, "max_chain": int,
        "chain_histogram": { "type": "array", "items": int }, "refused_inserts": int } },
      "ReloadReport": { "type": "object", "required": ["reloaded", "dry_run", "applied", "added", "changed", "removed"], "properties": {
        "reloaded": { "type": "boolean" }, "dry_run": { "type": "boolean" }, "applied": { "type": "boolean" },
        "added": { "type": "array", "items": s }, "changed": { "type": "array", "items": s },
        "removed": { "type": "array", "items": s } } },
      "HealthEntry": { "type": "object", "properties": {
        "tenant": s, "service": s, "backend": s, "state": s, "last_error": { "type": ["string", "null"] } } },
      "Whoami": { "type": "object", "required": ["role", "tenant", "can_write"], "properties": {
        "role": { "type": "string", "enum": ["full", "readonly", "tenant"] },
        "tenant": { "type": ["string", "null"] }, "can_write": { "type": "boolean" } } },
      "Figures": { "type": "object", "properties": {
        "tenants": { "type": "array" }, "services": { "type": "array" }, "global": { "type": "object" } } }
    })
}
