//! `lockctl members`: listing, adding, promoting and removing members.

use std::process::ExitCode;

use raftlock::server::proto::peer::{JoinClusterRequest, RemoveServerRequest};
use serde_json::json;

use crate::clients::{admin_client, tls_config};
use crate::output::{emit, fail, members_table, print_machine, print_table};
use crate::{peer_client, Args, MembersCmd};

pub(super) async fn members(args: &Args, action: &MembersCmd, json_out: bool) -> ExitCode {
    match action {
        MembersCmd::List => match admin_client(args) {
            Ok(admin) => match admin.members().await {
                Ok(v) => {
                    if json_out {
                        print_machine(&v);
                    } else {
                        print_table(
                            &members_table(&v, tls_config(args).ok().flatten().as_ref()).await,
                        );
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            },
            Err(e) => fail(e),
        },
        MembersCmd::Add {
            id,
            peer_addr,
            client_addr,
            via,
            peer,
        } => {
            // Certificates are read once, not on every hop to the leader.
            let dialer = match peer.dialer() {
                Ok(d) => d,
                Err(e) => return fail(e),
            };
            let mut target = via.clone();
            for _ in 0..5 {
                let req = JoinClusterRequest {
                    server_id: *id,
                    server_addr: peer_addr.clone(),
                    client_addr: client_addr.clone(),
                    // Said by the node itself when it joins; lockctl speaks for it.
                    version: 0,
                    incarnation: 0,
                    cluster_id: String::new(),
                };
                let reply = match peer_client(&dialer, &target).await {
                    Ok(mut c) => c.join_cluster(dialer.request(req)).await,
                    Err(e) => return fail(e),
                };
                match reply {
                    Ok(r) => {
                        let r = r.into_inner();
                        if r.success {
                            emit(json_out, json!({"added": id, "term": r.term}), || {
                                println!("added server {id} ({peer_addr}) as a learner; it is promoted once caught up")
                            });
                            return ExitCode::SUCCESS;
                        }
                        if !r.leader_addr.is_empty() && r.leader_addr != target {
                            target = r.leader_addr;
                            continue;
                        }
                        return fail(format!("join refused: {}", r.error));
                    }
                    Err(status) => return fail(format!("join failed: {}", status.message())),
                }
            }
            fail("no leader found within 5 hops")
        }
        MembersCmd::Remove { id, via, peer } => {
            let dialer = match peer.dialer() {
                Ok(d) => d,
                Err(e) => return fail(e),
            };
            let mut target = via.clone();
            for _ in 0..5 {
                let req = RemoveServerRequest { server_id: *id };
                let reply = match peer_client(&dialer, &target).await {
                    Ok(mut c) => c.remove_server(dialer.request(req)).await,
                    Err(e) => return fail(e),
                };
                match reply {
                    Ok(r) => {
                        let r = r.into_inner();
                        if r.success {
                            emit(json_out, json!({"removed": id}), || {
                                println!("removed server {id}")
                            });
                            return ExitCode::SUCCESS;
                        }
                        if !r.leader_addr.is_empty() && r.leader_addr != target {
                            target = r.leader_addr;
                            continue;
                        }
                        return fail(format!("remove refused: {}", r.error));
                    }
                    Err(status) => return fail(format!("remove failed: {}", status.message())),
                }
            }
            fail("no leader found within 5 hops")
        }
    }
}
