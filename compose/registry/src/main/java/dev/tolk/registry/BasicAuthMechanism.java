package dev.tolk.registry;

import io.quarkus.security.identity.IdentityProviderManager;
import io.quarkus.security.identity.SecurityIdentity;
import io.quarkus.security.identity.request.AuthenticationRequest;
import io.quarkus.vertx.http.runtime.security.BasicAuthenticationMechanism;
import io.quarkus.vertx.http.runtime.security.ChallengeData;
import io.quarkus.vertx.http.runtime.security.HttpAuthenticationMechanism;
import io.quarkus.vertx.http.runtime.security.HttpCredentialTransport;
import io.smallrye.mutiny.Uni;
import io.vertx.ext.web.RoutingContext;
import java.util.Set;
import javax.annotation.Priority;
import javax.enterprise.context.ApplicationScoped;
import javax.enterprise.inject.Alternative;

/**
 * The registry's one authentication mechanism: HTTP basic against Quarkus' embedded user store.
 *
 * <p>Apicurio's own mechanism (AppAuthenticationMechanism, an alternative at priority 1) replaces
 * every other: with its OIDC auth off it lets every request through as anonymous and has no
 * challenge to send (a request a policy refuses ends in a NullPointerException, no reply), and
 * with it on it needs a Keycloak. This alternative, at a higher priority, replaces it. In the
 * plain build (no policy, no user) a request without credentials is anonymous and served as
 * before; in the sasl_ssl build (compose/stack.sh: every path authenticated, users given at
 * start) it is asked for them (401) and a wrong password is refused.
 */
@Alternative
@Priority(10)
@ApplicationScoped
public class BasicAuthMechanism implements HttpAuthenticationMechanism {
  private final BasicAuthenticationMechanism basic =
      new BasicAuthenticationMechanism("tolk schema registry", false);

  @Override
  public Uni<SecurityIdentity> authenticate(
      RoutingContext context, IdentityProviderManager identityProviderManager) {
    return basic.authenticate(context, identityProviderManager);
  }

  @Override
  public Uni<ChallengeData> getChallenge(RoutingContext context) {
    return basic.getChallenge(context);
  }

  @Override
  public Set<Class<? extends AuthenticationRequest>> getCredentialTypes() {
    return basic.getCredentialTypes();
  }

  @Override
  public Uni<HttpCredentialTransport> getCredentialTransport(RoutingContext context) {
    return basic.getCredentialTransport(context);
  }
}
