//! Client authentication and authorization on the client port.
//!
//! With `--client-auth-file` (or `client_auth_file` in the configuration), every client request
//! must present a bearer token: the `Authorization: Bearer <token>` header (WebSocket upgrade,
//! HTTP, gRPC metadata `authorization`) or, for browsers, which cannot set headers on a
//! WebSocket, the `access_token` query parameter of the upgrade URL. The file names the
//! identities:
//!
//! ```json
//! {"identities": [
//!   {"name": "billing", "tokenSha256": "<hex of SHA-256 of the token>",
//!    "prefixes": ["billing/"], "operations": ["acquire", "release", "renew", "read"]},
//!   {"name": "ops", "token": "<the token itself>", "admin": true}
//! ]}
//! ```
//!
//! Each identity may do the listed operations (`acquire`, `release`, `renew`, `cancel`, `read`,
//! `write`; `admin` allows all) on keys that start with one of its prefixes (`admin` or no
//! `prefixes`: none; `[""]`: every key). The holder of a lock is the identity: a request's
//! `clientId` becomes `<identity>/<clientId>` (or just `<identity>` when it is empty or equal to
//! it), so no other identity can release or renew the lock whatever client id it sends. Only an
//! admin sees fencing tokens in `GET /locks`.
//!
//! Tokens are compared by their SHA-256 digests, in constant time.
//!
//! With `--client-jwt-key-file` (a shared secret of at least 32 bytes), a bearer token may also be
//! a JWT signed with HMAC-SHA256 (`alg` HS256, nothing else) by whoever holds the key — an
//! identity provider or `lockctl token` — carrying the identity and its rights, so adding a client
//! needs no change on the nodes:
//!
//! ```json
//! {"sub": "billing", "exp": 1790000000,
//!  "raftlock": {"prefixes": ["billing/"], "operations": ["acquire", "release", "renew"]}}
//! ```
//!
//! `exp` is required; `nbf` is honoured; `raftlock.admin: true` makes an admin. A JWT's identity is
//! its `sub`: the same name as a file identity is the same holder. Past `exp` every request is
//! refused `UNAUTHENTICATED`, also on a connection opened before.
//!
//! Without a file or key, the client port is open to anyone who reaches it (the default, for
//! loopback development).

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::node::api::{ApiError, ClientOp, ErrorCode};

/// What an identity may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Operation {
    Acquire,
    Release,
    Renew,
    Cancel,
    Read,
    Write,
}

/// One authenticated client identity.
#[derive(Debug)]
pub struct Identity {
    pub name: String,
    prefixes: Vec<String>,
    operations: Vec<Operation>,
    pub admin: bool,
    digest: [u8; 32],
    /// For a JWT: when it expires (Unix seconds).
    expires_at: Option<u64>,
}

impl Identity {
    /// Whether `key` is under one of this identity's prefixes (an admin: every key).
    fn covers(&self, key: &str) -> bool {
        !self.expired() && (self.admin || self.prefixes.iter().any(|p| key.starts_with(p.as_str())))
    }

    /// Whether this identity came from a JWT that has expired since.
    fn expired(&self) -> bool {
        self.expires_at.is_some_and(|exp| unix_now() > exp)
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct IdentityFile {
    name: String,
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    token_sha256: Option<String>,
    #[serde(default)]
    prefixes: Vec<String>,
    #[serde(default)]
    operations: Vec<Operation>,
    #[serde(default)]
    admin: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AuthFile {
    identities: Vec<IdentityFile>,
}

/// The identities a node accepts: from the file, and from JWTs signed with the key.
#[derive(Default)]
pub struct AuthTable {
    identities: Vec<Arc<Identity>>,
    jwt: Option<jsonwebtoken::DecodingKey>,
    rules: JwtRules,
}

/// What a JWT must say besides its signature, `sub` and `exp`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JwtRules {
    /// The `iss` it must carry.
    pub issuer: Option<String>,
    /// An `aud` it must name; None: `aud` is not checked.
    pub audience: Option<String>,
    /// How far ahead of now its `exp` may be, in seconds.
    pub max_lifetime_s: Option<u64>,
}

impl std::fmt::Debug for AuthTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthTable")
            .field("identities", &self.identities.len())
            .field("jwt", &self.jwt.is_some())
            .finish()
    }
}

/// The claims of a RaftLock JWT.
#[derive(Deserialize)]
struct JwtClaims {
    sub: String,
    exp: u64,
    #[serde(default)]
    raftlock: JwtRights,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct JwtRights {
    #[serde(default)]
    prefixes: Vec<String>,
    #[serde(default)]
    operations: Vec<Operation>,
    #[serde(default)]
    admin: bool,
}

/// Shortest JWT signing key accepted.
pub const MIN_JWT_KEY_BYTES: usize = 32;

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@'))
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Most identities one file may hold.
const MAX_IDENTITIES: usize = 10_000;
/// Longest bearer token looked at.
const MAX_TOKEN_BYTES: usize = 4096;

fn digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

fn parse_hex32(text: &str) -> Option<[u8; 32]> {
    let text = text.trim();
    if text.len() != 64 || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl AuthTable {
    /// Reads and checks the identities file; the error says which entry is wrong and why.
    pub fn from_file(path: &Path) -> Result<AuthTable, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the client auth file {}: {e}", path.display()))?;
        AuthTable::parse(&text).map_err(|e| format!("client auth file {}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> Result<AuthTable, String> {
        let file: AuthFile = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if file.identities.is_empty() || file.identities.len() > MAX_IDENTITIES {
            return Err(format!("needs 1..={MAX_IDENTITIES} identities"));
        }
        let mut identities: Vec<Arc<Identity>> = Vec::new();
        for (i, entry) in file.identities.into_iter().enumerate() {
            let at = format!("identity #{} ({:?})", i + 1, entry.name);
            if !valid_name(&entry.name) {
                return Err(format!("{at}: a name is 1..=128 of A-Z a-z 0-9 - _ . @"));
            }
            if identities.iter().any(|other| other.name == entry.name) {
                return Err(format!("{at}: the name is used twice"));
            }
            let digest = match (&entry.token, &entry.token_sha256) {
                (Some(token), None) if token.len() >= 16 && token.len() <= MAX_TOKEN_BYTES => {
                    digest(token.as_bytes())
                }
                (Some(_), None) => {
                    return Err(format!("{at}: a token is 16..={MAX_TOKEN_BYTES} bytes"))
                }
                (None, Some(hex)) => parse_hex32(hex)
                    .ok_or_else(|| format!("{at}: tokenSha256 must be 64 hex digits"))?,
                _ => return Err(format!("{at}: give exactly one of token and tokenSha256")),
            };
            if identities
                .iter()
                .any(|other| bool::from(other.digest.ct_eq(&digest)))
            {
                return Err(format!("{at}: the same token is given to another identity"));
            }
            if !entry.admin && (entry.operations.is_empty() || entry.prefixes.is_empty()) {
                return Err(format!(
                    "{at}: list its operations and key prefixes (or make it admin)"
                ));
            }
            identities.push(Arc::new(Identity {
                name: entry.name,
                prefixes: entry.prefixes,
                operations: entry.operations,
                admin: entry.admin,
                digest,
                expires_at: None,
            }));
        }
        Ok(AuthTable {
            identities,
            jwt: None,
            rules: JwtRules::default(),
        })
    }

    /// Also accepts JWTs signed (HS256) with the key in `path` (its bytes, trailing whitespace
    /// removed; at least [`MIN_JWT_KEY_BYTES`]).
    pub fn with_jwt_key_file(mut self, path: &Path) -> Result<AuthTable, String> {
        let key = read_jwt_key(path)?;
        self.jwt = Some(jsonwebtoken::DecodingKey::from_secret(&key));
        Ok(self)
    }

    /// With these rules for JWTs.
    pub fn with_jwt_rules(mut self, rules: JwtRules) -> AuthTable {
        self.rules = rules;
        self
    }

    /// The identity of a JWT signed with the key, or why it is not one.
    fn identify_jwt(&self, token: &str) -> Result<Arc<Identity>, &'static str> {
        let key = self
            .jwt
            .as_ref()
            .ok_or("the bearer token is not valid on this cluster")?;
        let mut validation = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::HS256);
        validation.validate_nbf = true;
        validation.leeway = 5;
        let mut required = vec!["exp", "sub"];
        match &self.rules.audience {
            Some(aud) => {
                validation.set_audience(&[aud]);
                required.push("aud");
            }
            None => validation.validate_aud = false,
        }
        if let Some(iss) = &self.rules.issuer {
            validation.set_issuer(&[iss]);
            required.push("iss");
        }
        validation.set_required_spec_claims(&required);
        let data =
            jsonwebtoken::decode::<JwtClaims>(token, key, &validation).map_err(|e| {
                match e.kind() {
                    jsonwebtoken::errors::ErrorKind::ExpiredSignature => {
                        "the bearer token has expired"
                    }
                    jsonwebtoken::errors::ErrorKind::ImmatureSignature => {
                        "the bearer token is not valid yet (nbf)"
                    }
                    jsonwebtoken::errors::ErrorKind::InvalidAudience => {
                        "the bearer token is not for this cluster (aud)"
                    }
                    jsonwebtoken::errors::ErrorKind::InvalidIssuer => {
                        "the bearer token's issuer (iss) is not the one this cluster trusts"
                    }
                    jsonwebtoken::errors::ErrorKind::MissingRequiredClaim(_) => {
                        "the bearer token lacks a claim this cluster requires (exp, sub, iss, aud)"
                    }
                    _ => "the bearer token is not valid on this cluster",
                }
            })?;
        let claims = data.claims;
        if let Some(max) = self.rules.max_lifetime_s {
            if claims.exp > unix_now().saturating_add(max) {
                return Err(
                    "the bearer token lives longer than this cluster allows: ask for one \
                     that expires sooner",
                );
            }
        }
        let rights = claims.raftlock;
        if !valid_name(&claims.sub) {
            return Err(
                "the token's sub is not a valid identity name (1..=128 of A-Z a-z 0-9 - _ . @)",
            );
        }
        if !rights.admin && (rights.prefixes.is_empty() || rights.operations.is_empty()) {
            return Err(
                "the token grants nothing: raftlock.prefixes and raftlock.operations are empty",
            );
        }
        Ok(Arc::new(Identity {
            name: claims.sub,
            prefixes: rights.prefixes,
            operations: rights.operations,
            admin: rights.admin,
            digest: digest(token.as_bytes()),
            expires_at: Some(claims.exp),
        }))
    }

    /// The identity whose token this is. Every identity is compared, in constant time, so the
    /// time taken says nothing about which one (if any) came close.
    pub fn identify(&self, token: &str) -> Option<Arc<Identity>> {
        if token.is_empty() || token.len() > MAX_TOKEN_BYTES {
            return None;
        }
        let presented = digest(token.as_bytes());
        let mut found = None;
        for identity in &self.identities {
            if bool::from(identity.digest.ct_eq(&presented)) {
                found = Some(identity.clone());
            }
        }
        found
    }
}

/// The HS256 key in a JWT key file: its bytes without trailing whitespace, at least
/// [`MIN_JWT_KEY_BYTES`] of them (what the nodes verify with and `lockctl token` signs with).
pub fn read_jwt_key(path: &Path) -> Result<Vec<u8>, String> {
    let text = std::fs::read(path)
        .map_err(|e| format!("cannot read the JWT key file {}: {e}", path.display()))?;
    let key = text.trim_ascii_end();
    if key.len() < MIN_JWT_KEY_BYTES {
        return Err(format!(
            "JWT key file {}: the key must be at least {MIN_JWT_KEY_BYTES} bytes",
            path.display()
        ));
    }
    Ok(key.to_vec())
}

/// The client port's security settings.
#[derive(Debug, Default)]
pub struct ClientSecurity {
    /// Identities, replaced when their files change; `None`: the client port is open.
    auth: Option<std::sync::RwLock<Arc<AuthTable>>>,
    /// Where `auth` comes from, and the bytes it was last read from.
    sources: AuthSources,
    /// Fencing-token MACs for the data store; `None`: tokens carry no MAC.
    pub fencing_key: Option<crate::fencing::FencingKey>,
}

#[derive(Debug, Default)]
struct AuthSources {
    auth_file: String,
    jwt_key_file: String,
    rules: JwtRules,
    last: std::sync::Mutex<Vec<u8>>,
}

impl AuthSources {
    /// The files' bytes, one after the other (what a change is told by).
    fn read(&self) -> Result<Vec<u8>, String> {
        let mut bytes = Vec::new();
        for path in [&self.auth_file, &self.jwt_key_file] {
            if !path.is_empty() {
                let content =
                    std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
                bytes.extend_from_slice(&(content.len() as u64).to_be_bytes());
                bytes.extend_from_slice(&content);
            }
        }
        Ok(bytes)
    }

    /// The table the files describe (None when both names are empty).
    fn table(&self) -> Result<Option<AuthTable>, String> {
        let table = match (self.auth_file.is_empty(), self.jwt_key_file.is_empty()) {
            (true, true) => return Ok(None),
            (false, _) => AuthTable::from_file(Path::new(&self.auth_file))?,
            (true, false) => AuthTable::default(),
        };
        let table = if self.jwt_key_file.is_empty() {
            table
        } else {
            table.with_jwt_key_file(Path::new(&self.jwt_key_file))?
        };
        Ok(Some(table.with_jwt_rules(self.rules.clone())))
    }
}

impl ClientSecurity {
    /// Loads the files named in the configuration (empty names: off).
    pub fn load(
        client_auth_file: &str,
        client_jwt_key_file: &str,
        fencing_key_file: &str,
    ) -> Result<ClientSecurity, String> {
        Self::load_with(
            client_auth_file,
            client_jwt_key_file,
            JwtRules::default(),
            fencing_key_file,
        )
    }

    /// [`ClientSecurity::load`] with rules for JWTs.
    pub fn load_with(
        client_auth_file: &str,
        client_jwt_key_file: &str,
        rules: JwtRules,
        fencing_key_file: &str,
    ) -> Result<ClientSecurity, String> {
        let sources = AuthSources {
            auth_file: client_auth_file.to_string(),
            jwt_key_file: client_jwt_key_file.to_string(),
            rules,
            last: Default::default(),
        };
        let bytes = sources.read()?;
        let auth = sources
            .table()?
            .map(|t| std::sync::RwLock::new(Arc::new(t)));
        *sources.last.lock().unwrap_or_else(|e| e.into_inner()) = bytes;
        let fencing_key = if fencing_key_file.is_empty() {
            None
        } else {
            Some(
                crate::fencing::FencingKey::from_file(Path::new(fencing_key_file))
                    .map_err(|e| e.to_string())?,
            )
        };
        Ok(ClientSecurity {
            auth,
            sources,
            fencing_key,
        })
    }

    /// Whether clients must authenticate.
    pub fn authenticates(&self) -> bool {
        self.auth.is_some()
    }

    /// Reads the identity file and the JWT key file again; true when they changed and the new
    /// table was taken. A file that cannot be read or parsed is refused with the reason, and the
    /// table in use stays (as with certificates). Open connections keep the identity they had.
    pub fn reload_if_changed(&self) -> Result<bool, String> {
        let Some(current) = &self.auth else {
            return Ok(false);
        };
        let bytes = self.sources.read()?;
        let mut last = self.sources.last.lock().unwrap_or_else(|e| e.into_inner());
        if *last == bytes {
            return Ok(false);
        }
        // Taken as seen even when refused: a broken file is reported once, not every check.
        *last = bytes;
        let Some(table) = self.sources.table()? else {
            return Ok(false);
        };
        *current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
        Ok(true)
    }

    /// The caller behind an `Authorization` header value and/or an `access_token` parameter.
    pub fn caller(&self, authorization: Option<&str>, access_token: Option<&str>) -> Caller {
        let token = authorization.and_then(bearer).or(access_token);
        let table = self
            .auth
            .as_ref()
            .map(|t| t.read().unwrap_or_else(|e| e.into_inner()).clone());
        Caller::from_token(table.as_deref(), token)
    }
}

/// The token in an `Authorization` header value (`Bearer <token>`, scheme case-insensitive).
pub fn bearer(header: &str) -> Option<&str> {
    let (scheme, token) = header.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Who is calling, as far as the client port knows.
#[derive(Clone, Debug)]
pub enum Caller {
    /// Authentication is off: anyone may do anything.
    Open,
    Authenticated(Arc<Identity>),
    /// Authentication is on and no valid token came with the request; the reason says what was
    /// wrong.
    Refused(&'static str),
}

impl Caller {
    /// The caller behind `token` (from a header or query parameter), given the node's table.
    pub fn from_token(table: Option<&AuthTable>, token: Option<&str>) -> Caller {
        match (table, token) {
            (None, _) => Caller::Open,
            (Some(_), None) => Caller::Refused(
                "this node requires a bearer token: send `Authorization: Bearer <token>` (or \
                 `?access_token=` on the WebSocket URL); the SDK's `auth_token` and lockctl's \
                 `--token` do this",
            ),
            (Some(table), Some(token)) => match table.identify(token) {
                Some(identity) => Caller::Authenticated(identity),
                // A JWT has three dot-separated parts; a file token may have dots too, so the
                // file is asked first.
                None if token.len() <= MAX_TOKEN_BYTES && token.matches('.').count() == 2 => {
                    match table.identify_jwt(token) {
                        Ok(identity) => Caller::Authenticated(identity),
                        Err(reason) => Caller::Refused(reason),
                    }
                }
                None => Caller::Refused("the bearer token is not valid on this cluster"),
            },
        }
    }

    /// Checks only that the caller is authenticated (or that authentication is off): a refused
    /// or expired token is `UNAUTHENTICATED`. Used at the WebSocket upgrade, before a
    /// connection slot is taken.
    pub fn check_authenticated(&self) -> Result<(), ApiError> {
        match self {
            Caller::Open => Ok(()),
            Caller::Refused(reason) => Err(ApiError::new(ErrorCode::Unauthenticated, *reason)),
            Caller::Authenticated(identity) if identity.expired() => Err(ApiError::new(
                ErrorCode::Unauthenticated,
                "the bearer token has expired: reconnect with a fresh one",
            )),
            Caller::Authenticated(_) => Ok(()),
        }
    }

    /// How long until this caller's token expires (None: it does not).
    pub fn expires_in(&self) -> Option<std::time::Duration> {
        match self {
            Caller::Authenticated(identity) => identity.expires_at.map(|exp| {
                std::time::Duration::from_secs(exp.saturating_sub(unix_now()))
                    + std::time::Duration::from_millis(500)
            }),
            _ => None,
        }
    }

    /// Whether this caller may see fencing tokens of others (`GET /locks`).
    pub fn sees_tokens(&self) -> bool {
        match self {
            Caller::Open => true,
            Caller::Authenticated(identity) => identity.admin && !identity.expired(),
            Caller::Refused(_) => false,
        }
    }

    /// Whether a lock on `key` appears in this caller's `GET /locks`: an identity sees the keys
    /// under its prefixes.
    pub fn check_read_listing(&self, key: &str) -> bool {
        match self {
            Caller::Open => true,
            Caller::Authenticated(identity) => identity.covers(key),
            Caller::Refused(_) => false,
        }
    }

    /// Checks that the caller may read `key` (HTTP `GET /kv`, a linearizable read).
    pub fn check_read(&self, key: &str) -> Result<(), ApiError> {
        self.check(Operation::Read, key)
    }

    /// Checks that the caller may do `operation` on some key (a session names none).
    fn check_operation(&self, operation: Operation) -> Result<(), ApiError> {
        match self {
            Caller::Authenticated(identity) if !identity.admin && !identity.expired() => {
                let key = identity.prefixes.first().map_or("", String::as_str);
                self.check(operation, key)
            }
            _ => self.check(operation, ""),
        }
    }

    /// Checks that the caller may do `operation` on `key`.
    pub fn check(&self, operation: Operation, key: &str) -> Result<(), ApiError> {
        let identity = match self {
            Caller::Open => return Ok(()),
            Caller::Refused(reason) => {
                return Err(ApiError::new(ErrorCode::Unauthenticated, *reason))
            }
            Caller::Authenticated(identity) => identity,
        };
        if identity.expired() {
            return Err(ApiError::new(
                ErrorCode::Unauthenticated,
                "the bearer token has expired: reconnect with a fresh one",
            ));
        }
        if identity.admin {
            return Ok(());
        }
        if !identity.operations.contains(&operation) {
            return Err(ApiError::new(
                ErrorCode::PermissionDenied,
                format!(
                    "identity {:?} may not {} (allowed: {:?})",
                    identity.name,
                    format!("{operation:?}").to_lowercase(),
                    identity.operations
                ),
            ));
        }
        if !identity.covers(key) {
            return Err(ApiError::new(
                ErrorCode::PermissionDenied,
                format!(
                    "identity {:?} may use only keys starting with {:?}",
                    identity.name, identity.prefixes
                ),
            ));
        }
        Ok(())
    }

    /// Checks `op` against the caller's rights and makes the authenticated identity its holder:
    /// the client id becomes `<identity>/<clientId>` (or `<identity>`).
    pub fn authorize(&self, op: &mut ClientOp) -> Result<(), ApiError> {
        let operation = match op.request() {
            ClientOp::Acquire { .. }
            | ClientOp::Campaign { .. }
            | ClientOp::AcquireShared { .. } => Operation::Acquire,
            // A semaphore's size holds back (or lets in) every client of the key: an operator's
            // setting, like a lock-delay.
            ClientOp::SetPermits { .. } if !self.sees_tokens() => {
                return Err(ApiError::new(
                    ErrorCode::PermissionDenied,
                    "setting a semaphore's size needs an admin identity",
                ))
            }
            ClientOp::SetPermits { .. } => Operation::Write,
            ClientOp::Proclaim { .. } => Operation::Renew,
            ClientOp::Leader { .. } => Operation::Read,
            ClientOp::Release { .. } | ClientOp::ReleaseHeld { .. } => Operation::Release,
            ClientOp::Renew { .. } => Operation::Renew,
            ClientOp::CancelWait { .. } => Operation::Cancel,
            ClientOp::Put { .. } | ClientOp::Delete { .. } => Operation::Write,
            ClientOp::Get { .. } | ClientOp::Sequenced { .. } => Operation::Read,
            // A key's lock-delay holds back every client of the key: an operator's setting.
            ClientOp::SetLockDelay { .. } if !self.sees_tokens() => {
                return Err(ApiError::new(
                    ErrorCode::PermissionDenied,
                    "setting a key's lock-delay needs an admin identity",
                ))
            }
            ClientOp::SetLockDelay { .. } => Operation::Write,
            // A session is the client's own (its id is rewritten under the identity below): it
            // names no key, so only the operation is checked.
            ClientOp::KeepAlive { .. } => Operation::Renew,
            ClientOp::EndSession { .. } => Operation::Release,
        };
        match op.request() {
            ClientOp::KeepAlive { .. } | ClientOp::EndSession { .. } => {
                self.check_operation(operation)?
            }
            _ => self.check(operation, op.key())?,
        }
        // A guarded write names a lock too: it must be one the caller may use.
        if let ClientOp::Put { guard: Some(g), .. } | ClientOp::Delete { guard: Some(g), .. } =
            op.request()
        {
            self.check(Operation::Write, &g.key)?;
        }
        if let (Caller::Authenticated(identity), Some(client_id)) = (self, op.client_id_mut()) {
            *client_id = if client_id.is_empty() || *client_id == identity.name {
                identity.name.clone()
            } else {
                format!("{}/{client_id}", identity.name)
            };
        }
        Ok(())
    }

    /// Whether a lock held by `holder` (a client id as recorded in the log) is this caller's:
    /// with authentication, the identity's own (`<identity>` or `<identity>/…`).
    pub fn holds_as(&self, holder: &str) -> bool {
        match self {
            Caller::Open => true,
            Caller::Authenticated(identity) => {
                holder == identity.name
                    || holder
                        .strip_prefix(identity.name.as_str())
                        .is_some_and(|rest| rest.starts_with('/'))
            }
            Caller::Refused(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"{"identities": [
        {"name": "billing", "token": "billing-token-0123456789", "prefixes": ["billing/"],
         "operations": ["acquire", "release", "renew"]},
        {"name": "ops", "tokenSha256": "HASH", "admin": true}
    ]}"#;

    fn table() -> AuthTable {
        let hash: String = digest(b"ops-token-0123456789abc")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        AuthTable::parse(&FILE.replace("HASH", &hash)).unwrap()
    }

    fn acquire(key: &str, client: &str) -> ClientOp {
        ClientOp::Acquire {
            key: key.into(),
            client_id: client.into(),
            request_id: "r".into(),
            ttl_ms: 1000,
            wait_timeout_ms: None,
        }
    }

    #[test]
    fn identities_rights_and_holders() {
        let t = table();
        let billing = Caller::from_token(Some(&t), Some("billing-token-0123456789"));
        let mut op = acquire("billing/run", "w1");
        billing.authorize(&mut op).unwrap();
        assert!(matches!(&op, ClientOp::Acquire { client_id, .. } if client_id == "billing/w1"));
        let mut op = acquire("billing/run", "");
        billing.authorize(&mut op).unwrap();
        assert!(matches!(&op, ClientOp::Acquire { client_id, .. } if client_id == "billing"));
        let err = billing
            .authorize(&mut acquire("payroll/run", "w1"))
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::PermissionDenied);
        let err = billing
            .authorize(&mut ClientOp::Get {
                key: "billing/x".into(),
            })
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::PermissionDenied);
        assert!(!billing.sees_tokens());

        let ops = Caller::from_token(Some(&t), Some("ops-token-0123456789abc"));
        ops.authorize(&mut acquire("anything", "x")).unwrap();
        assert!(ops.sees_tokens());

        for caller in [
            Caller::from_token(Some(&t), None),
            Caller::from_token(Some(&t), Some("billing-token-0123456788")),
        ] {
            let err = caller
                .authorize(&mut acquire("billing/run", "w1"))
                .unwrap_err();
            assert_eq!(err.code, ErrorCode::Unauthenticated);
        }
        let open = Caller::from_token(None, None);
        let mut op = acquire("k", "w1");
        open.authorize(&mut op).unwrap();
        assert!(matches!(&op, ClientOp::Acquire { client_id, .. } if client_id == "w1"));
    }

    #[test]
    fn bad_files_are_explained() {
        for (text, needle) in [
            (r#"{"identities": []}"#, "identities"),
            (
                r#"{"identities": [{"name": "a b", "token": "0123456789abcdef", "admin": true}]}"#,
                "name",
            ),
            (
                r#"{"identities": [{"name": "a", "token": "short", "admin": true}]}"#,
                "16",
            ),
            (
                r#"{"identities": [{"name": "a", "admin": true}]}"#,
                "exactly one",
            ),
            (
                r#"{"identities": [{"name": "a", "token": "0123456789abcdef"}]}"#,
                "prefixes",
            ),
            (
                r#"{"identities": [{"name": "a", "token": "0123456789abcdef", "admin": true},
                                {"name": "b", "token": "0123456789abcdef", "admin": true}]}"#,
                "another",
            ),
            (
                r#"{"identities": [{"name": "a", "tokenSha256": "zz", "admin": true}]}"#,
                "64 hex",
            ),
            (
                r#"{"identities": [{"name": "a", "token": "0123456789abcdef", "admin": true, "x": 1}]}"#,
                "unknown field",
            ),
        ] {
            let err = AuthTable::parse(text).unwrap_err();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }

    #[test]
    fn bearer_headers() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer  abc "), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer "), None);
    }
}
